"""Developer tools of effattn's backends (not part of the installed package): see tools/triton/README.md."""
