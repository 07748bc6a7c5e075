"""The training process: the trainer entry, models and methods applied, losses, callbacks, rewards, the memory probe. (ARCHITECTURE.md)"""
