"""The daemon: composition root, lifecycle, sd_notify, embedded Redis, descriptor and stats."""
