"""Summarise a `headrace serve --profile-steps` log (written by daemon/step_profile.py)."""
