"""Hugging Face model families, shrunk to a CPU size with their structure kept.

``load_config`` reads a ``config.json`` (or gives a ``model_type``'s default configuration),
``shrink`` cuts it to a size a CPU runs, ``build_model`` builds the causal language model
from it (nothing is downloaded) and ``token_batch`` makes a padded token batch with labels.

transformers is an optional extra (``pip install 'dpverify[hf]'``): importing this package
does not import it; the functions do, and say what to install when it is missing.
"""

from dpverify.hf.base import load_config as load_config
from dpverify.hf.model import TokenBatch as TokenBatch
from dpverify.hf.model import build_model as build_model
from dpverify.hf.model import dropout_fields as dropout_fields
from dpverify.hf.model import lm_loss as lm_loss
from dpverify.hf.model import token_batch as token_batch
from dpverify.hf.shrink import SEQ_LEN as SEQ_LEN
from dpverify.hf.shrink import WINDOW as WINDOW
from dpverify.hf.shrink import parameter_count as parameter_count
from dpverify.hf.shrink import shrink as shrink

__all__ = [
    "SEQ_LEN",
    "WINDOW",
    "TokenBatch",
    "build_model",
    "dropout_fields",
    "lm_loss",
    "load_config",
    "parameter_count",
    "shrink",
    "token_batch",
]
