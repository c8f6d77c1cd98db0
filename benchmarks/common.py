"""What the benchmark scripts share: the machine's name, timing, memory, and the results writer.

Every script imports this module (and no script imports one that imports it back): the CPU
named in each table, the alternating rounds that give every ratio, the peak resident memory of
a child process, and the writer that puts a table between its markers in BENCHMARKS.md.

    cpu_name()                          the CPU and its bfloat16 matrix units
    Fed(run, inputs), NEW_INPUTS         a compiled step fed new input values every call,
                                        drawn outside the timed region (NEW_INPUTS says so)
    alternate(ours, peer, rounds, repeats)
                                        two steps in alternating rounds of `repeats` calls:
                                        median times and the median and range of the ratios
    time_alternating(steps, rounds)     seconds of named steps, one call each a round
    rss_mib(), PeakSampler              resident memory now, and its peak while a step runs
    child_peak_mib(module, step_args)   the peak of one call of `module.make_step(*step_args)`,
                                        in a child
    at_least_one(parser, args, *names)  the flags that must be at least 1
    command_line(script, argv)          the script's command, for "Produced by:"
    replace_section(path, start, end, section)
                                        the section between two markers of a Markdown file
    write_head(path, head)              the part of a Markdown file before its first section
    export_commit(commit, folder)       a commit's `keras_sdpa/`, importable as `keras_sdpa_before`
"""

import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_name():
    """The CPU's model name, family and model numbers, as the app's runs name it (two AMD EPYCs
    differ threefold there; `apps/files.py` is not imported: importing `apps` sets
    the TensorFlow backend, and some scripts here run JAX), and its bfloat16 matrix units, from
    /proc/cpuinfo (Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown CPU"
    fields = {
        key.strip(): value.strip()
        for key, value in (line.split(":", 1) for line in lines if ":" in line)
    }
    model = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']}, model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    units = [
        name
        for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"))
        if flag in flags
    ]
    return f"{model}, {os.cpu_count()} logical CPUs, " + (
        " and ".join(units) if units else "no AMX or AVX-512 BF16"
    )


# ---- timing

# What every table of a compiled step says of its inputs (`Fed`).
NEW_INPUTS = (
    "Every timed call gets new input values (floats drawn anew, masks and ids rotated over the "
    "batch), made before its clock starts: a compiled program fed the same tensors again can "
    "hide a recompilation."
)


class Fed:
    """A compiled step and the inputs it is fed, new values on every call.

    `run(*inputs)` is the step; `inputs` are its first inputs, the templates of the rest.
    `draw()` makes the next call's inputs, of the same shapes and dtypes: floats drawn anew
    (normal, with the template's mean and spread), integers and booleans (masks, ids,
    positions) rotated by one along the batch axis, so that their values change and their
    structure does not. The timers call `draw()` before their clock starts; calling the
    object draws and runs, untimed. On TensorFlow and JAX alike: the new values are
    `keras.ops` tensors.
    """

    def __init__(self, run, inputs, seed=0):
        import keras
        import numpy as np

        self.run = run
        self.arrays = [np.asarray(keras.ops.convert_to_numpy(x)) for x in inputs]
        self.spreads = [_mean_and_spread(x) for x in self.arrays]  # (mean, std) of floats
        self.rng = np.random.default_rng(seed)

    def draw(self):
        import keras
        import numpy as np

        new = []
        for index, (x, stats) in enumerate(zip(self.arrays, self.spreads)):
            if stats is not None:
                mean, spread = stats
                x = (self.rng.standard_normal(x.shape, "float32") * spread + mean).astype(x.dtype)
            elif x.ndim:
                x = np.roll(x, 1, axis=0)
            self.arrays[index] = x
            new.append(keras.ops.convert_to_tensor(x, str(x.dtype)))
        return new

    def __call__(self):
        return self.run(*self.draw())


def _mean_and_spread(x):
    """`(mean, std)` of a floating array of data (std 1 where it has none), else None: also
    for floats that hold a mask (infinities, or only 0 and 1), which are rotated instead."""
    import numpy as np

    if x.dtype.kind != "f" and str(x.dtype) != "bfloat16":
        return None
    wide = x.astype("float32")
    if not wide.size:
        return 0.0, 1.0
    if not np.isfinite(wide).all() or np.isin(wide, (0.0, 1.0)).all():
        return None
    return float(wide.mean()), float(wide.std()) or 1.0


def _timed_call(step):
    """Seconds of one call of `step`: a `Fed` step's inputs are drawn before the clock."""
    if isinstance(step, Fed):
        inputs = step.draw()
        start = time.perf_counter()
        step.run(*inputs)
    else:  # a step whose inputs are new by construction (a dataset's next batches)
        start = time.perf_counter()
        step()
    return time.perf_counter() - start


def time_calls(step, repeats):
    """Median seconds of `repeats` calls."""
    return statistics.median(_timed_call(step) for _ in range(repeats))


def alternate(ours, peer, rounds, repeats):
    """Alternating rounds of two warmed-up steps: median times and per-round ratios. Who
    goes first swaps every round, so neither always follows the other."""
    ours(), peer()  # trace and compile both
    mine, theirs = [], []
    for index in range(rounds):
        pairs = [(mine, ours), (theirs, peer)]
        for times, step in pairs if index % 2 == 0 else pairs[::-1]:
            times.append(time_calls(step, repeats))
    ratios = sorted(a / b for a, b in zip(mine, theirs))
    return {
        "ms": statistics.median(mine) * 1e3,
        "peer_ms": statistics.median(theirs) * 1e3,
        "ratio": statistics.median(ratios),
        "low": ratios[0],
        "high": ratios[-1],
    }


def time_alternating(steps, rounds):
    """Seconds of each of `steps` (name -> callable), once per round, after one call that
    traces and compiles; the order reverses every round, so none always runs first."""
    for step in steps.values():
        step()  # trace and compile
    seconds = {name: [] for name in steps}
    for index in range(rounds):
        order = list(steps.items())
        for name, step in order if index % 2 == 0 else order[::-1]:
            seconds[name].append(_timed_call(step))
    return seconds


# ---- memory


def rss_mib():
    """Current resident memory of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakSampler:
    """Samples resident memory every millisecond in a thread; `stop()` gives the peak."""

    def __init__(self):
        self.peak = rss_mib()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            self.peak = max(self.peak, rss_mib())
            time.sleep(0.001)

    def stop(self):
        self.running = False
        self.thread.join()
        return max(self.peak, rss_mib())


def child_peak_mib(module, step_args, timeout=1800):
    """In a child process: the peak resident MiB of one call of `module.make_step(*step_args)`
    above the level once the step is made and its inputs drawn (weights and inputs in, nothing
    traced or run yet; compilation included), or `"exit <code>"`."""
    script = (
        f"import sys, json; sys.path.insert(0, {HERE!r}); import {module} as m; "
        "from common import Fed, PeakSampler, rss_mib; "
        f"step = m.make_step(*{tuple(step_args)!r}); "
        "run, inputs = (step.run, step.draw()) if isinstance(step, Fed) else (step, ()); "
        "base = rss_mib(); s = PeakSampler(); run(*inputs); print(json.dumps(s.stop() - base))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode:
        return f"exit {result.returncode}"
    return round(json.loads(result.stdout.strip().splitlines()[-1]))


# ---- arguments and results


def at_least_one(parser, args, *names):
    """Stops with a usage error naming the first of `names` (flags) below 1, and its value."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1. Received: {getattr(args, name)}")


def command_line(script, argv):
    """`python benchmarks/<script> <arguments>`: the command that made a table."""
    arguments = " ".join(argv if argv else sys.argv[1:])
    return f"python benchmarks/{os.path.basename(script)} {arguments}".strip()


def _write(path, text):
    """Writes `path` atomically and says where, on stderr."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    print(f"wrote {os.path.abspath(path)}", file=sys.stderr)


def cpu_key():
    """This CPU as a marker's suffix, such as `intel-r-xeon-r-processor-family-6-model-167`."""
    name = re.sub(r", \d+ logical CPUs.*", "", cpu_name())
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def replace_section(path, start, end, section, *, before=None, missing=""):
    """Replaces the part of a Markdown file between two markers, markers kept. Without them
    the block goes before the first `before` (such as `"\\n## Notes"`) when given and found,
    else at the end. `missing` is the file's text when there is no file yet.

    A section that another CPU measured is kept: this CPU's goes into its own, marked with
    `cpu_key()` (`<!-- name@key:start -->`), after the other's, and is replaced there on the
    next run on this CPU."""
    old = open(path).read() if os.path.exists(path) else missing
    if start in old and end in old and cpu_name() not in old[old.index(start) : old.index(end)]:
        after = end
        start, end = (marker.replace(":", f"@{cpu_key()}:", 1) for marker in (start, end))
        if start not in old:
            at = old.index(after) + len(after)
            old = old[:at] + f"\n\n{start}\n{end}" + old[at:]
    block = f"{start}\n{section}\n{end}"
    if start in old and end in old:
        new = old[: old.index(start)] + block + old[old.index(end) + len(end) :]
    elif before is not None and before in old:
        at = old.index(before)
        new = old[:at] + "\n" + block + "\n" + old[at:]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    _write(path, new)


def write_head(path, head):
    """Replaces the part of a Markdown file before its first later section (a marked one, or
    a `## ` heading), which is kept with all that follows it."""
    notes = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        starts = [old.find(mark) for mark in ("\n<!-- ", "\n## ") if mark in old]
        if starts:  # from the first later section, with its markers
            notes = "\n" + old[min(starts) + 1 :]
    _write(path, head + notes)


def export_commit(commit, folder):
    """The commit's `keras_sdpa/` as the package `keras_sdpa_before` under `folder`."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "keras_sdpa"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            text = tar.extractfile(member).read().decode()
            # `from keras_sdpa import x`, `import keras_sdpa.ops`, "keras_sdpa._backend.jax";
            # not the name its objects are registered under with Keras ("keras_sdpa").
            text = re.sub(r"\bkeras_sdpa\b(?=[.\s])", "keras_sdpa_before", text)
            path = os.path.join(folder, member.name.replace("keras_sdpa", "keras_sdpa_before", 1))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, folder)
