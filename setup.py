"""Packaging for hf_slideformer: full-parameter fine-tuning of LLMs larger than the GPU."""
from setuptools import find_packages, setup

setup(
    name="hf_slideformer",
    version="0.1.0",
    description="Full-parameter fine-tuning of large language models on one GPU through a sliding window of layers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hf_slideformer", "hf_slideformer.*", "triton_ops", "triton_ops.*"]),
    package_data={"hf_slideformer": ["data/*.txt", "host/csrc/*.c", "host/csrc/*.h"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.17,<6",
        "accelerate>=1.10",
        "peft>=0.21",
        "safetensors>=0.4",
        "tokenizers>=0.21",
        "tqdm",
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        # kvikio (GPUDirect Storage) for the disk layer: 'nvme' for CUDA 13, 'nvme-cu12' for CUDA 12.
        "nvme": ["kvikio-cu13"],
        "nvme-cu12": ["kvikio-cu12"],
        # TRL's SFTTrainer / DPOTrainer on a slid model (docs/integration.md, "TRL").
        "trl": ["trl>=1.16", "datasets"],
        "test": ["pytest>=8", "pytest-timeout", "nbclient", "nbformat", "ipykernel", "triton>=3.0", "trl>=1.16",
                 "datasets",
                 # the reference the 8-bit host AdamW is held to in tests (not a runtime dependency)
                 "bitsandbytes>=0.50"],
    },
    entry_points={"console_scripts": ["hf-slideformer=hf_slideformer.cli:main"]},
)
