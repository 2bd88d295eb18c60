"""Mitigation: the control-file protocol between greyhound-trace and the
training script (writer and trainer-side reader), the micro-batch solver,
pipeline re-split, checkpoint-restart and the policy that picks among them.
"""
