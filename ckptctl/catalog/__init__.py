"""What a checkpoint is, read by every domain: ``ls`` and ``inspect``, the files a checkpoint
owns and needs, its parts, its state, the one JSON vocabulary.

Imports formats, storage and the foundations (model, errors, parts, ...); nothing above."""
