from rayapp.cli import run

run()
