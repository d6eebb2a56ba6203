"""``torchrun ... -m trainer <flags>``: one training rank."""

from trainer.cli import run

run()
