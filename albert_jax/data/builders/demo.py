"""`albert_demo`: the small public-domain corpus shipped with the package.

290 documents (Jane Austen's six novels by chapter, State of the Union addresses 2001–2021;
see albert_jax/data/demo/README.md and ATTRIBUTION.md), enough for a tiny ALBERT to learn
something in minutes on a CPU. Built like any `documents` dataset, with 5% held out.
"""

from __future__ import annotations

import pathlib

from albert_jax.data.builders.documents import Documents, DocumentsConfig

# Inside the installed package: a local path by definition.
DEMO_DIR = str(pathlib.Path(__file__).absolute().parent.parent / "demo")
DEMO_FILE = str(pathlib.Path(DEMO_DIR) / "demo.jsonl.gz")


class Demo(Documents, skip_registration=True):
    """The shipped demo corpus (no inputs to give: the file is part of the package)."""

    name = "albert_demo"
    DESCRIPTION = "Demo corpus shipped with albert_jax: Jane Austen's novels and recent SOTU."
    BUILDER_CONFIGS = [
        DocumentsConfig(
            name="default",
            files=(DEMO_FILE,),
            validation_fraction=0.05,
            text_format="jsonl",
            description="Austen's six novels (by chapter) + State of the Union 2001-2021.",
        )
    ]
