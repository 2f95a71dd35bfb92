"""ResiHP-Megatron: resilient GPT pretraining on megatron-core.

Installs two packages: ``resihp_ext`` (pure decision logic) and ``megatron.resihp`` (the
training front end that sits beside megatron-core's ``megatron.core`` in the ``megatron``
namespace package; there is deliberately no ``megatron/__init__.py``).
"""

from setuptools import find_namespace_packages, setup

setup(
    name="resihp-megatron",
    version="0.1.0",
    description="Resilient Megatron-LM: in-place TP/PP/DP re-planning on fail-slow and fail-stop",
    python_requires=">=3.12",
    packages=find_namespace_packages(include=["resihp_ext", "resihp_ext.*", "megatron.resihp", "megatron.resihp.*"]),
    py_modules=["pretrain_gpt_resilient"],
    install_requires=[
        # 0.19 ships Megatron-LM's training package (megatron.training) beside megatron.core.
        "megatron-core==0.19.2",
        "psutil",
        "torch>=2.6",
        "numpy",
        "scipy",
        "packaging",
    ],
    extras_require={
        # NVIDIA apex is built from source (the PyPI package named "apex" is unrelated).
        "te": ["transformer_engine[pytorch]"],
        "tensorboard": ["tensorboard"],
        # Megatron's HuggingFaceTokenizer and GPT2BPETokenizer build on transformers.
        "hf": ["transformers"],
        "test": ["pytest", "hypothesis"],
    },
)
