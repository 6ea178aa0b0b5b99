import sys

from benchmarks.gpu import kit

sys.exit(kit.main())
