"""Training: the loop, checkpoints, evaluation in bits per byte, ``torchrun`` set-up."""

from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, load_model
from .config import TrainConfig
from .evaluate import evaluate_bpb
from .trainer import train

__all__ = ["train", "TrainConfig", "evaluate_bpb", "load_checkpoint", "load_model", "Checkpoint", "CheckpointError"]
