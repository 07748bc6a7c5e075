"""Shipping a model: merge, safetensors and GGUF export, the Ollama Modelfile. (ARCHITECTURE.md)"""
