"""albert_jax: ALBERT (arXiv 1909.11942) in JAX/Flax, TPU-first."""

import pathlib

from setuptools import find_packages, setup

# The jax release the package is tested with; the [tpu] extra pins libtpu through it.
JAX_VERSION = "0.10.2"

setup(
    name="albert_jax",
    version="0.1.0",
    description="ALBERT pretraining and fine-tuning in JAX/Flax, TPU-first.",
    long_description=pathlib.Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # configs/ ships as the top-level package `configs`: the config files import
    # `configs.common`, and the package reads them by name (glue_table's per-task configs, the
    # fields a run config may have), from any working directory.
    packages=find_packages(include=["albert_jax", "albert_jax.*", "configs"]),
    include_package_data=True,
    package_data={"albert_jax": ["data/demo/*"]},
    install_requires=[
        f"jax>={JAX_VERSION}",
        "flax>=0.12.8",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.12.8",
        "tensorflow-datasets>=4.9.9",
        # TFDS builds datasets through tf.data; TPU VMs use the CPU build of TensorFlow.
        "tensorflow-cpu>=2.18",
        "sentencepiece>=0.2.0",
        # Sentence splitting for pretraining examples; its model ships inside the wheel.
        "blingfire>=0.1.8",
        # Wiki markup -> text for local MediaWiki dumps.
        "mwparserfromhell>=0.6",
        # TFDS imports it to prepare builders defined inside a package but does not declare it.
        "importlib_resources>=6.0",
        "ml-collections>=1.1.0",
        "absl-py>=2.1.0",
        "numpy>=1.26",
        # Reading (and writing) HF `model.safetensors` without torch: the format's own parser,
        # which refuses overlapping or out-of-range tensor offsets.
        "safetensors>=0.4.3",
        "tensorboard>=2.18",
        "matplotlib>=3.9",  # learning-curve plot written at the end of a run
        "etils[epath]>=1.7",  # workdir I/O on local disks and gs:// alike
        # The gs:// workdir lease: objects created only if absent (generation preconditions),
        # which neither epath nor tf.io.gfile can ask for.
        "google-cloud-storage>=2.18",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.6",  # the suite runs one worker per core (pyproject addopts)
            "filelock>=3.12",  # tests/conftest.py: the workers build the session's runs once
            "ruff>=0.6",
            "scipy>=1.13",
            "scikit-learn>=1.5",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            # tests/gcs.py: a local Cloud Storage emulator for the gs:// tests (and gcsfs, the
            # fsspec client checked against it).
            "gcp-storage-emulator>=2026.7.19",
            "gcsfs>=2024.2",
        ],
        # HF interop: PyTorch CPU build (install torch==2.13.0 first to avoid CUDA wheels).
        # transformers 4.x: v5 dropped load_tf_weights_in_albert and Flax ALBERT (our peers).
        # `convert --to=onnx` (interop/onnx_export.py): torch's torch.export-based ONNX
        # exporter (torch >= 2.6 for its arguments; tested with 2.13) needs onnx and onnxscript;
        # onnxruntime runs the file (its tests, benchmarks/inference.py): opset 20, from 1.17.
        "hf": [
            "torch>=2.4",
            "transformers>=4.46,<5",
            "onnx>=1.16",
            "onnxscript>=0.5",
            "onnxruntime>=1.17",
        ],
        # benchmarks/train_step.py's KerasHub peer (Keras 3 on JAX). Not in CI's install: its
        # tensorflow-text requirement pulls the full `tensorflow` wheel on top of tensorflow-cpu.
        # The peer only needs `pip install --no-deps keras-hub kagglehub kagglesdk`.
        "peers": ["keras-hub>=0.32; python_version >= '3.11'"],
        # The TPU compiler for `python -m albert_jax.plan` on any machine: jax's own [tpu] extra
        # at the jax version installed with the package, which pins the libtpu it was built with
        # (an unpinned newer libtpu compiles other programs, and hit a compiler error on v5p).
        "tpu": [f"jax[tpu]=={JAX_VERSION}"],
    },
)
