"""A model answering: the generation engine, `tuneboard chat` and the OpenAI-compatible `tuneboard api`. (ARCHITECTURE.md)"""
