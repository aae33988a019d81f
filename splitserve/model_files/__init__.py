"""Finding a model's files: a directory, a GGUF file, an HF ID, or the demo model
(downloaded once). Torch-free, so every tier may resolve the model it serves."""
