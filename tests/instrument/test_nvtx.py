"""NVTX emission proven with a real injection library, as Nsight Systems attaches."""
import os
import subprocess
import sys
import textwrap



SCRIPT = textwrap.dedent(
    """
    import threading
    import pptrace

    @pptrace.region("compute:optimizer")
    def optimizer_step():
        pass

    with pptrace.region("compute:fwd", mb=1, chunk=0):
        with pptrace.region("pp:send_fwd", peer=3, mb=1, bytes=4096):
            pass
        with pptrace.region("tp:all_reduce layer=2"):
            pass
    optimizer_step()
    t = threading.Thread(target=lambda: pptrace.region("dp:wait", op="all_reduce", bucket=0).__enter__().__exit__())
    t.start(); t.join()
    """
)


def _record(tmp_path, recorder, extra_env=None):
    script = tmp_path / "use_pptrace.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "NVTX_INJECTION64_PATH": str(recorder),
           "NVTX_RECORDER_OUT": str(tmp_path / "nvtx.%p.log"), **(extra_env or {})}
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    logs = list(tmp_path.glob("nvtx.*.log"))
    return [line.split(" ", 5) for line in logs[0].read_text().splitlines()] if logs else []


def test_region_emits_nested_nvtx_ranges_with_domain_and_category(tmp_path, recorder):
    events = _record(tmp_path, recorder)
    main_tid = events[0][1]
    main = [e for e in events if e[1] == main_tid]
    assert [(e[0], e[2]) + tuple(e[3:]) for e in main] == [
        ("push", "0", "pptrace", "compute", "compute:fwd mb=1 chunk=0"),
        ("push", "1", "pptrace", "pp", "pp:send_fwd peer=3 mb=1 bytes=4096"),
        ("pop", "1", "pptrace"),
        ("push", "1", "pptrace", "tp", "tp:all_reduce layer=2"),
        ("pop", "1", "pptrace"),
        ("pop", "0", "pptrace"),
        ("push", "0", "pptrace", "compute", "compute:optimizer"),
        ("pop", "0", "pptrace"),
    ]
    other = [e for e in events if e[1] != main_tid]
    assert [e[0] for e in other] == ["push", "pop"]
    assert other[0][2:] == ["0", "pptrace", "dp", "dp:wait op=all_reduce bucket=0"]


def test_nvtx_disable_emits_nothing(tmp_path, recorder):
    assert _record(tmp_path, recorder, {"NVTX_DISABLE": "1"}) == []
