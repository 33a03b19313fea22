"""The models checks run on: the built-in ones (``builtin``), the generated ones and their
losses and scenarios as data (``specs``; Hypothesis draws them in ``dpverify.strategies``),
and a user's model with its batch recipe (``user``)."""
