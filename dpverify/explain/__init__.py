"""``dpverify explain``'s engine: what DataParallel does to one step, measured and worded.

- ``measure``: runs the step with hooks and returns an ``Explanation`` of facts;
- ``answers``: the numbered answers of ``docs/questions.md``, written from those facts.

The command line draws both (``dpverify.cli.explain_view``) and ``dpverify.figures.explain``
draws them as a figure; neither is imported from here.
"""
