"""``python -m ckptctl``."""
from .cli.main import main

main()
