"""Integrations with other libraries (``mixers.integrations.transformers``: Hugging Face models).

Each submodule imports its library only when used; nothing here is imported by ``mixers``.
"""
