"""MkDocs hook: the pages show the figures the apps and benchmarks wrote, where they wrote them.

The images live beside the runs that made them (`saved_models/...`, `benchmarks/...`), not in
`docs/`; this adds them to the site under the same paths. A page links them as GitHub reads
it, from `docs/`: `../saved_models/imdb_sdpa/viewer.png`, and `../BENCHMARKS.md` for the
benchmarks; on the site those links are rewritten to the added files and to `benchmarks.md`
(which includes BENCHMARKS.md), so the build fails if a file is gone.
"""

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ["saved_models/imdb_sdpa/*.png", "saved_models/math_verified/*.png", "benchmarks/*.png"]
# A link from docs/ up to the repository, as GitHub resolves it -> the site's path.
UP = re.compile(r"\]\(\.\./(saved_models/|benchmarks/|BENCHMARKS\.md)")


def on_files(files, config):
    for pattern in FIGURES:
        for path in sorted(ROOT.glob(pattern)):
            relative = path.relative_to(ROOT).as_posix()
            files.append(
                File(relative, str(ROOT), config["site_dir"], config["use_directory_urls"])
            )
    return files


def on_page_markdown(markdown, page, config, files):
    return UP.sub(lambda m: "](" + ("benchmarks.md" if m[1] == "BENCHMARKS.md" else m[1]), markdown)
