"""Judging a model: `tuneboard eval`, prediction, metrics, reward scoring. (ARCHITECTURE.md)"""
