"""Run the documentation's code blocks as tests: ``make test-docs``.

pytest-markdown-docs (``pytest --markdown-docs``) makes every ``python`` fence of
``README.md``, ``docs/*.md`` and ``docs/howto/*.md`` a test; a ``python notest``
fence is shown only. A ``python continuation`` fence goes on from the blocks
before it on the same page: the plugin runs it as the source of the whole chain,
which re-runs every fit above it (a page of n fitting blocks would cost
n (n + 1) / 2 fits). The runner below keeps the namespace of each page's last
block that passed and runs only the new block in it, so each block runs once; a
chain whose previous block did not pass in this session (a ``-k`` selection, a
failure) runs whole, as the plugin would run it. ``register_runner`` is not in
the plugin's README, hence the pin ``pytest-markdown-docs<0.10`` of the test extra.

Every block also sees ``np``, ``pm`` and ``pymc_mcssvi``: each page states these
imports once at the top, as the prose around its snippets assumes.
"""

from dataclasses import replace

import numpy as np
import pymc as pm
from pytest_markdown_docs._runners import DefaultRunner, register_runner

import pymc_mcssvi


def pytest_markdown_docs_globals():
    return {"np": np, "pm": pm, "pymc_mcssvi": pymc_mcssvi}


@register_runner(default=True)
class PageRunner(DefaultRunner):
    """The plugin's runner, with each page's namespace kept between its blocks."""

    def __init__(self):
        # path -> (source of the last block that passed, its namespace)
        self.pages: dict[str, tuple[str, dict]] = {}

    def runtest(self, test, args, *, asyncio_runner=None):
        page, chain = str(test.source_path), test.source
        done, namespace = self.pages.pop(page, ("", None))
        if namespace is not None and done.strip() and chain.startswith(done):
            # the new block only, at its line numbers on the page
            test = replace(test, source="\n" * done.count("\n") + chain[len(done) :])
        else:
            namespace = args
        super().runtest(test, namespace, asyncio_runner=asyncio_runner)
        self.pages[page] = (chain, namespace)
