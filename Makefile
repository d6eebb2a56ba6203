# ranksight: `make demo` and `make test` do all set-up on a fresh machine.
#  - a virtual environment in .venv
#  - torch 2.13.0 (the CPU build on disk) only when no torch is importable
#  - the package with its dev extra (editable)
#  - Debian packages the tests use (prometheus, prometheus-alertmanager) when missing and root
#  - the simulated NVML library (probes/simnvml) when gcc is present

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ranksight-installed
SIMNVML_SRC := probes/simnvml/simnvml.c
SIMNVML_LIB := probes/simnvml/libnvidia-ml.so.1
DEBS   := prometheus prometheus-alertmanager tmux

.PHONY: setup venv debs simnvml test demo clean report-shots tui-shot

setup: $(STAMP) debs simnvml

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	@# torch: take the CPU build on disk unless a torch is already importable.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# Debian packages for the integration tests. Installed only when missing and we are root;
# otherwise the tests that need them say so.
debs:
	@missing=""; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v prometheus-alertmanager >/dev/null 2>&1 || missing="$$missing prometheus-alertmanager"; \
	command -v tmux >/dev/null 2>&1 || missing="$$missing tmux"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian packages:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEBS) >/dev/null) \
	      || echo "WARNING: could not install$$missing; tests that need them will fail"; \
	  else \
	    echo "NOTE: missing$$missing and not root: install them to run the Prometheus/Alertmanager tests"; \
	  fi; \
	fi

simnvml: $(if $(wildcard $(SIMNVML_SRC)),$(SIMNVML_LIB))

$(SIMNVML_LIB): $(SIMNVML_SRC)
	@if command -v gcc >/dev/null 2>&1; then \
	  gcc -O2 -shared -fPIC -Wall -o $@ $< && echo "built $@ (simulated NVML)"; \
	else echo "NOTE: no gcc: the agent will use the pure-Python GPU simulator"; fi

# The suite runs on TEST_WORKERS pytest-xdist workers (the CPU count, at least 2 and at most 4), one test file per
# worker at a time (--dist loadfile: a file's module fixtures are built once). Most tests wait on real processes
# (torchrun, agents, a head, Prometheus), so a second worker fills the core the first leaves idle.
# `make test TEST_WORKERS=0` runs it in one process; PYTEST_ARGS adds pytest options (e.g. -k, -x).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 2 ] && n=2; [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# pytest exits 5 when it collected no tests: that is a failure of the suite, say so.
test: setup
	@$(PY) -m pytest $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

demo: setup
	$(PY) -m cli.demo

# The README's screenshot of the diagnose report: the newest demo run's HTML page (make demo first), rendered by
# headless Chromium at 1280 px into docs/img/report.png and checked not blank. REPORT_RUN=runs/<id> picks another run.
REPORT_RUN ?= $(lastword $(sort $(wildcard runs/demo-*)))
REPORT_PNG ?= docs/img/report.png
report-shots: setup
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian package: chromium"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; \
	  else echo "report-shots: needs Chromium (Debian package chromium); not root, so not installed"; exit 2; fi; }
	@test -n "$(REPORT_RUN)" || { echo "report-shots: no demo run under runs/: run 'make demo' first"; exit 1; }
	@mkdir -p build
	@# diagnose exits 0/10/20/30 by what it found; 40 is a run it could not read
	$(PY) -m cli.diagnose $(notdir $(REPORT_RUN)) --store $(patsubst %/,%,$(dir $(REPORT_RUN))) --html build/report.html >/dev/null; \
	  rc=$$?; [ $$rc -lt 40 ] || { echo "report-shots: diagnose could not read $(REPORT_RUN) (exit $$rc)"; exit 1; }
	$(PY) -m analyzers.report.screenshot build/report.html $(REPORT_PNG) --width 1280 --height 2200

# docs/img/tui.svg: the TUI's screen (Textual's screenshot) of a run. With RANKSIGHT_HEAD (and RANKSIGHT_TOKEN) set, a
# running head (e.g. during `make demo`: the live view); without, a head started on the store (RANKSIGHT_STORE or
# ./runs) for the picture. TUI_RUN picks the run (default: the one seen last), TUI_SIZE the terminal (160x48).
tui-shot: setup
	$(PY) -m tui.shot --out docs/img/tui.svg --size $(or $(TUI_SIZE),160x48) $(if $(TUI_RUN),--run $(TUI_RUN))

clean:
	rm -rf $(VENV) build *.egg-info $(SIMNVML_LIB) runs/demo-*
