"""Training: config, the pure jitted step, chunked loss, checkpoints and the loop."""

from jaxtune.training.config import TrainConfig
from jaxtune.training.loop import TrainingDiverged, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "train"]
