#!/usr/bin/env python
"""manage.py for the benchmark project (settings: bench/settings.py).

Usable by hand, e.g.
    BENCH_SYSTEM=jobs BENCH_DB=sqlite BENCH_SQLITE_PATH=/tmp/b.sqlite3 \
        python bench/manage.py migrate
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for entry in (str(HERE), str(HERE.parent)):  # bench/ (benchjobs) and the repo root (django_jobs)
    if entry not in sys.path:
        sys.path.append(entry)  # after PYTHONPATH, so run.py --ref can put an exported django_jobs first

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
