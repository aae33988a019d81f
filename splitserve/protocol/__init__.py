"""Torch-free wire shapes shared by every tier."""
