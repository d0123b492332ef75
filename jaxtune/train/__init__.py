"""Training: config, the pure jitted step, chunked loss, checkpoints and the loop."""

from jaxtune.train.config import TrainConfig
from jaxtune.train.loop import TrainingDiverged, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "train"]
