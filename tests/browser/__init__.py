"""Real-browser tests (Playwright + Debian Chromium); see conftest.py."""
