"""Tests of ``transfer/``.

``transfer`` is imported first: it imports torch with torch's "NumPy missing" import warning
silenced, which ``filterwarnings = error`` would otherwise turn into a collection error.
"""

import transfer  # noqa: F401
