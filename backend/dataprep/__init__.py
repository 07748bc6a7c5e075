"""Rows to tokens: dataset loading and mixing, chat templates, preprocessing (masks, packing), preference pairs, preview. (ARCHITECTURE.md)"""
