"""``python -m nccl_tests <op>_perf [flags]`` (under torchrun: ``torchrun ... -m nccl_tests ...``)."""

from nccl_tests.cli import main

if __name__ == "__main__":
    main()
