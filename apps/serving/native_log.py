"""TensorFlow's native log set aside while the predictor runs (`native_log_set_aside`).

Like `apps/serving/predict.py`, it imports neither Keras nor keras_sdpa.
"""

import contextlib
import os
import sys
import tempfile

NATIVE_LOG_LINES = 30  # of TensorFlow's own log, shown when the predictor fails


_TERMINAL = None  # stderr on a copy of file descriptor 2, made once, never closed


def _terminal(previous, descriptor):
    """A stream on a copy of `descriptor` (the terminal's), made once for the process and
    never closed: logging handlers that TensorFlow makes while the log is set aside hold it,
    and write to the terminal after."""
    global _TERMINAL
    if _TERMINAL is None:
        encoding = previous.encoding or "utf-8"
        _TERMINAL = open(
            os.dup(descriptor), "w", encoding=encoding, errors="backslashreplace", buffering=1
        )
    return _TERMINAL


@contextlib.contextmanager
def native_log_set_aside(keep=False):
    """TensorFlow's and XLA's C++ log lines go to a log file, not the terminal.

    They are written straight to file descriptor 2 (TensorFlow 2.21 prints its start-up lines
    whatever `TF_CPP_MIN_LOG_LEVEL` says, and its persistent XLA cache logs every entry it
    loads). `sys.stderr` keeps the terminal (a copy of the descriptor), so this program's own
    messages, progress and tracebacks still show; absl's Python warnings below ERROR are
    dropped (loading the SavedModel warns that its attention has no saved gradient, which
    serving never asks for).

    The log is `keras_sdpa_predict_*.log` in the temporary folder, removed when the block ends
    well. If it raises, the log's last `NATIVE_LOG_LINES` lines and its path are printed; if the
    process crashes in native code, `faulthandler` prints the Python stack to the terminal and
    the log stays. With `keep`, or without a terminal or a temporary folder, nothing is set
    aside. For the command line: one block at a time, from one thread.
    """
    previous = sys.stderr
    log = None
    if not keep and previous is not None:
        try:
            previous.flush()
            log = tempfile.NamedTemporaryFile(
                prefix="keras_sdpa_predict_", suffix=".log", delete=False
            )
        except (OSError, ValueError):
            log = None  # no temporary folder, or stderr closed: leave it all as it is
    if log is None:
        yield
        return
    import faulthandler
    import logging

    absl = logging.getLogger("absl")
    level = absl.level
    faults = faulthandler.is_enabled()
    saved = os.dup(2)
    failed = False
    try:
        os.dup2(log.fileno(), 2)
        if _descriptor(previous) == 2:  # else (a test's capture, a StringIO) it is not on fd 2
            sys.stderr = _terminal(previous, saved)
        absl.setLevel(logging.ERROR)
        if _descriptor(sys.stderr) is not None:
            faulthandler.enable(file=sys.stderr)
        yield
    except Exception as error:
        failed = not isinstance(error, BrokenPipeError)  # a closed pipe is not a failure
        if failed:
            _print_log_tail(log)
        raise
    finally:
        absl.setLevel(level)
        if not faults:
            faulthandler.disable()
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if sys.stderr is _TERMINAL and previous is not _TERMINAL:
            sys.stderr = previous
        log.close()
        if not failed:
            with contextlib.suppress(OSError):
                os.unlink(log.name)


def _print_log_tail(log):
    with contextlib.suppress(OSError, ValueError):
        log.flush()
        with open(log.name, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()[-NATIVE_LOG_LINES:]
        if lines:
            print(
                f"TensorFlow's log ({log.name}), its last lines:", *lines, sep="\n", file=sys.stderr
            )


def _descriptor(stream):
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None  # io.UnsupportedOperation is an OSError and a ValueError
