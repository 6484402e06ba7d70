"""exit_reason: the cause lines of a termination message, as the operator's Events quote them."""

from __future__ import annotations

from pathlib import Path

from rljob.operator.exit_message import exit_reason
from rljob.operator.pod_waits import pod_wait

# The last 2 KB of a real log (the kubelet's FallbackToLogsOnError): torchrun whose rank died on SIGABRT
# with faulthandler on (made with `python -m torch.distributed.run` of a script calling os.abort()).
TORCHRUN_SIGABRT = (Path(__file__).parent / "data" / "torchrun_sigabrt_tail.txt").read_text()


def test_a_torchrun_log_tail_gives_the_root_cause_not_the_cut_first_line() -> None:
    assert not TORCHRUN_SIGABRT.startswith("exitcode")  # the tail starts mid-line, in the module list
    reason = exit_reason(TORCHRUN_SIGABRT)
    assert reason.startswith("exitcode : -6"), reason
    assert "Signal 6 (SIGABRT) received by PID" in reason, reason
    assert "ChildFailedError" in reason, reason


def test_the_runtime_s_own_one_line_reason_is_kept_as_it_is() -> None:
    assert exit_reason("Interrupted: SIGTERM after step 3; its checkpoint is written\n") == (
        "Interrupted: SIGTERM after step 3; its checkpoint is written")
    assert exit_reason("") == ""


def test_a_cpp_terminate_and_a_python_exception_are_found() -> None:
    log = "\n".join([
        "step 4 done",
        "terminate called after throwing an instance of 'gloo::IoException'",
        "  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.7]:41234",
        "Fatal Python error: Aborted",
        "",
        "Thread 0x00007f (most recent call first):",
        '  File "/opt/rljob/x.py", line 3 in f',
    ])
    assert exit_reason(log) == (
        "terminate called after throwing an instance of 'gloo::IoException' | "
        "what(): [gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.7]:41234 | "
        "Fatal Python error: Aborted")
    traceback = 'Traceback (most recent call last):\n  File "a.py", line 1\nValueError: bad batch size 0\n'
    assert exit_reason(traceback) == "ValueError: bad batch size 0"


def test_a_log_without_a_cause_line_gives_its_last_line() -> None:
    assert exit_reason("loading\nstep 1\nKilled\n") == "Killed"


def test_a_crash_loop_wait_quotes_the_cause() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {}, "status": {"phase": "Running", "containerStatuses": [{
        "name": "trainer", "restartCount": 3, "ready": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": TORCHRUN_SIGABRT}}}]}}
    wait = pod_wait(pod, {})
    assert wait is not None and "exitcode : -6" in wait.message, wait
