"""The command line (``python -m specjax`` / ``specjax``: ``main``) and the
demo it runs (``demo``)."""
