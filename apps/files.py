"""File helpers every app may import: atomic writes, figures, the machine's name.

Nothing here imports the rest of `apps`: the classifier, serving, inspection, training and the
math app all write their files through it.
"""

import json
import os


def write_text_atomic(path, text):
    """Writes `text` (a string, or an iterable of strings) to `path` as UTF-8, via a
    temporary file and a rename: an interrupted write never leaves half a file."""
    temporary = f"{path}.partial"
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines([text] if isinstance(text, str) else text)
    os.replace(temporary, path)
    return path


def write_json_atomic(path, payload):
    return write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def pyplot():
    """`matplotlib.pyplot` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path):
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot().close(figure)


def machine():
    """The machine as the reports name it: the CPU's model, its family and model numbers where
    /proc/cpuinfo gives them (two "AMD EPYC"s differ threefold in this app's
    step), and its logical CPUs: "AMD EPYC (family 26, model 2), 2 logical CPUs"."""
    cores = os.cpu_count()
    where = f"{cores} logical CPUs" if cores else "this machine"
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        fields = {}
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    if "model name" not in fields:
        return where
    name = fields["model name"]
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}, {where}"
