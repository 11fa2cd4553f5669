"""``python -m pagedgen.parallel FD``: a tensor-parallel worker rank on the inherited pipe ``FD``
(started by :class:`pagedgen.parallel.runner.TensorParallelRunner`; not a user command)."""

import sys
from multiprocessing.connection import Connection

from pagedgen.parallel.worker import worker_main

if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
