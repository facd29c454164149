"""Which engines the zygote may fork (kvtier/tools/engine_zygote.py): the environment a forked
child gets is the one a process started afresh would have after the same import, and an engine
asking for other import-time values is refused (it starts afresh)."""

from __future__ import annotations

from kvtier.tools.engine_zygote import env_as_if_imported

BEFORE = {"VLLM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1", "PATH": "/bin", "HOME": "/root"}
# What the zygote's import of vLLM set: a default of its own, and a path cv2 prepends.
AFTER = {**BEFORE, "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti", "LD_LIBRARY_PATH": "/cv2/lib64"}


def test_an_engine_of_the_zygotes_environment_gets_what_its_own_import_would_have_set():
    want = {**BEFORE, "PYTEST_CURRENT_TEST": "x", "KVTIER_ENGINE_ZYGOTE": "/tmp/z.sock"}
    assert env_as_if_imported(want, BEFORE, AFTER) == {**want, "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti",
                                                       "LD_LIBRARY_PATH": "/cv2/lib64"}


def test_a_caller_that_imported_vllm_itself_passes_on_what_the_import_set():
    want = {**AFTER, "PYTEST_XDIST_WORKER": "gw1"}
    assert env_as_if_imported(want, BEFORE, AFTER) == want


def test_other_import_time_values_are_refused():
    assert env_as_if_imported({**BEFORE, "OMP_NUM_THREADS": "2"}, BEFORE, AFTER) is None
    assert env_as_if_imported({**BEFORE, "VLLM_CPU_KVCACHE_SPACE": "4"}, BEFORE, AFTER) is None
    assert env_as_if_imported({"OMP_NUM_THREADS": "1"}, BEFORE, AFTER) is None  # VLLM_LOGGING_LEVEL missing
    assert env_as_if_imported({**BEFORE, "LD_LIBRARY_PATH": "/elsewhere"}, BEFORE, AFTER) is None
    # Any variable, not only vLLM's or torch's: an import may read HOME, TMPDIR, PYTORCH_*, TRITON_*.
    assert env_as_if_imported({**BEFORE, "TMPDIR": "/elsewhere"}, BEFORE, AFTER) is None
    assert env_as_if_imported({**BEFORE, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, BEFORE, AFTER) is None


def test_an_engine_whose_halves_run_apart_forks_for_vllm_reads_that_when_it_starts():
    want = {**BEFORE, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert env_as_if_imported(want, {**BEFORE, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, AFTER)[
        "VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
