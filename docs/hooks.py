"""MkDocs hook: the pages show the figures the apps and benchmarks wrote, where they wrote them.

The images live beside the runs that made them (`saved_models/...`, `benchmarks/...`), not in
`docs/`; this adds them to the site under the same paths, so a page links
`saved_models/imdb_sdpa/viewer.png` and the build fails if the file is gone.
"""

import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ["saved_models/imdb_sdpa/*.png", "saved_models/math_verified/*.png", "benchmarks/*.png"]


def on_files(files, config):
    for pattern in FIGURES:
        for path in sorted(ROOT.glob(pattern)):
            relative = path.relative_to(ROOT).as_posix()
            files.append(
                File(relative, str(ROOT), config["site_dir"], config["use_directory_urls"])
            )
    return files
