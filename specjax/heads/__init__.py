"""Draft heads for decoding: the EAGLE-3 and EAGLE-1 modules (``eagle``),
their portable files (``export``: ``load_head``, ``save_head``) and draft
vocabularies (``vocab``); the heads specjax ships sit beside them as
``.npz``. Nothing here imports the trainer (``specjax.training``)."""
