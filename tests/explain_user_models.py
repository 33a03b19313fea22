"""Models as a user writes them, for ``dpverify explain`` and ``dpverify check`` on the same
model and inputs (imported as ``explain_user_models:token_lm`` with ``--inputs
explain_user_models:token_batch``; the tests put this directory on sys.path).

- ``token_lm``: an embedding and a linear head whose forward returns the token-mean
  cross-entropy over the labels that are not -100 (padding), as a language model does.
- ``seq_first_lstm``: ``nn.LSTM`` without ``batch_first``, fed T x B x F: the batch is
  along dim 1, so DataParallel must be given ``dim=1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 11
LENGTH = 7
STEPS = 5  # the LSTM's time steps: the default explain batch has as many rows


class TokenLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def token_lm() -> nn.Module:
    torch.manual_seed(0)
    return TokenLM()


def token_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
    """Token ids and their labels, each row padded (-100) after 2 to 6 real tokens: rows
    hold different numbers of tokens, so chunks of equal rows do too."""
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, LENGTH), generator=g)
    labels = ids.clone()
    for row in range(batch_size):
        labels[row, 2 + row % 5 :] = -100
    return (ids, labels), None


class SeqFirstLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _state = self.lstm(x)
        return self.head(out)


def seq_first_lstm() -> nn.Module:
    torch.manual_seed(0)
    return SeqFirstLSTM()


def seq_first_batch(batch_size: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """T x B x F inputs and T x B x 3 targets: the batch along dim 1."""
    g = torch.Generator().manual_seed(batch_size)
    return (torch.randn(STEPS, batch_size, 4, generator=g),), torch.randn(STEPS, batch_size, 3, generator=g)


def tiny_bert() -> nn.Module:
    """A BERT classifier from a tiny local config (nothing downloaded); its batch is inferred
    from the first layer, its loss cross-entropy on the logits."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
    )
    return transformers.BertForSequenceClassification(config).eval()  # eval: no dropout


def tiny_gpt2() -> nn.Module:
    """A GPT-2 language model from a tiny local config, whose forward given ``labels``
    returns the mean loss over the shifted tokens that are not -100."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout


def gpt2_batch(batch_size: int) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    """Token ids, and as keyword ``labels`` the same ids padded (-100) after 3 to 6 tokens."""
    (ids, labels), _target = token_batch(batch_size)
    for row in range(batch_size):
        labels[row, 3 + row % 4 :] = -100
    return (ids,), {"labels": labels}
