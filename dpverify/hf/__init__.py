"""Hugging Face model families under dpverify's checks (``pip install 'dpverify[hf]'``).

Nothing here imports transformers until it is used.
"""
