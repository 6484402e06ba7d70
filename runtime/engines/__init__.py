"""Inference engines behind one async interface (see base.Engine)."""
