"""Hugging Face model families checked under their own parallel plans (``pip install 'dpverify[hf]'``).

Every module here imports transformers inside its functions, so ``import dpverify`` never
imports it.
"""
