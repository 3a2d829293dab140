"""Experiment sweeps over workflows, policies, models and tasks, and their reports."""
