"""rmt: a megatron-core based pretraining framework for memory-centric language models.

The C++/CUDA kernels in csrc/ are torch extensions built by ``python -m rmt.ops.extensions``
(``launch/setup_env.sh`` runs it after installing) or else on first use, once per environment;
a plain ``pip install -e .`` needs no compiler step.
"""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "triton==3.9.0",
    "deepspeed==0.19.8",
    "datasets==5.2.0",
    "tokenizers==0.23.3",
    "tensorboard==2.21.0",
    "omegaconf==2.4.0",
    "pyyaml==6.0.3",
    "tqdm==4.70.1",
    "numpy==2.4.6",
    "matplotlib==3.11.2",
    "ninja==1.13.2",
    "psutil==7.2.2",
    "scipy==1.17.1",
    # rmt-export writes and test-loads Hugging Face models
    "transformers==5.24.0",
    "safetensors==0.8.0",
]

setup(
    name="rmt",
    version="0.1.0",
    description="Megatron-core pretraining of memory-centric LMs: RMT, UltraMem, recurrent "
    "transformers and repeat mixers, with sharded memory tables and a planner",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["rmt", "rmt.*"]),
    install_requires=INSTALL_REQUIRES,
    # bench: FBGEMM's table-batched embeddings, the peer tools/bench_lookup_reduce.py times beside
    # lookup_reduce (its CPU build for torch 2.13; 1.9.0 is built for torch 2.14)
    # eval: lm-evaluation-harness for rmt-eval (it pulls scikit-learn, sacrebleu, evaluate, ...)
    # dev: the test suite (pytest, xdist, file locks) and ruff, which tests/test_lint.py runs
    extras_require={
        "dev": ["pytest==9.2.0", "pytest-xdist==3.8.0", "filelock==4.3.1", "ruff==0.16.9"],
        "bench": ["fbgemm-gpu-cpu==1.8.0"],
        "eval": ["lm-eval==0.4.13"],
    },
    # the local lm-eval task of rmt-eval (YAMLs, its data and loader); the code files rmt-export
    # writes beside remote-code weights
    package_data={"rmt.evaluation": ["tasks/*.yaml", "tasks/*.json", "tasks/*.py"], "rmt.export": ["remote_code/*.py"]},
    entry_points={
        "console_scripts": [
            "rmt-train=rmt.training.cli:main",
            "rmt-preprocess=rmt.data.preprocess:main",
            "rmt-plan=rmt.planner.cli:main",
            "rmt-generate=rmt.generate:main",
            "rmt-eval=rmt.evaluation.cli:main",
            "rmt-export=rmt.export.cli:main",
        ]
    },
)
