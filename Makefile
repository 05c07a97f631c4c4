# kvr - build, test, bench, install. Plain GNU make; dependencies come from Debian's packages
# (see README.md): OpenBLAS, stb, and for the optional parts OpenMPI and the CUDA toolkit.
#
#   make              library and tools into build/
#   make test         every test (plus a second build under ASan+UBSan and a bounded fuzz run)
#   make bench        the benchmarks (long: about two hours; not part of make test)
#   make install PREFIX=/usr/local

CC        ?= cc
CLANG     ?= clang
ARCHFLAGS ?= -march=native
OPT       ?= -O2
WARN      := -Wall -Wextra -Werror
CFLAGS    += -std=c11 $(OPT) $(ARCHFLAGS) $(WARN) -pthread -I. -fno-math-errno
LDLIBS    += -lopenblas -lm -lpthread
PREFIX    ?= /usr/local
FUZZ_SECONDS ?= 30
SHARED    ?= ../shared
# sources linked into every program during development of separate pieces (normally empty)
EXTRA_SRCS ?=

BUILD     := build
ASAN      := build/asan
LIB_SRCS  := kvr.c kvr-comm.c kvr-tune.c
LIB_DEPS  := kvr.h kvr.c kvr-comm.c kvr-tune.c $(wildcard models/*.c) $(EXTRA_SRCS)
# make KVR_MPI=1: ranks as MPI processes (Debian's OpenMPI)
ifeq ($(KVR_MPI),1)
CC        := mpicc
CFLAGS    += -DKVR_MPI
endif
TOOLS     := $(patsubst tools/%.c,$(BUILD)/%,$(wildcard tools/*.c))
TESTS     := $(patsubst tests/%.c,$(BUILD)/%,$(filter-out tests/fuzz-%.c,$(wildcard tests/test-*.c)))
ASAN_TESTS:= $(patsubst tests/%.c,$(ASAN)/%,$(filter-out tests/fuzz-%.c,$(wildcard tests/test-*.c)))
SANFLAGS  := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all

.PHONY: all tools tests test test-fast test-asan fuzz bench install clean help demo mpi

all: $(BUILD)/libkvr.a tools

help:
	@sed -n '1,10p' Makefile

$(BUILD) $(ASAN):
	mkdir -p $@

$(BUILD)/kvr.o: $(LIB_DEPS) | $(BUILD)
	$(CC) $(CFLAGS) -c kvr.c -o $@

$(BUILD)/kvr-comm.o: $(LIB_DEPS) | $(BUILD)
	$(CC) $(CFLAGS) -c kvr-comm.c -o $@

$(BUILD)/kvr-tune.o: $(LIB_DEPS) | $(BUILD)
	$(CC) $(CFLAGS) -c kvr-tune.c -o $@

$(BUILD)/libkvr.a: $(BUILD)/kvr.o $(BUILD)/kvr-comm.o $(BUILD)/kvr-tune.o
	ar rcs $@ $^

tools: $(TOOLS)

$(BUILD)/%: tools/%.c kvr.h $(wildcard tools/*.h) $(BUILD)/libkvr.a | $(BUILD)
	$(CC) $(CFLAGS) $< $(BUILD)/libkvr.a $(EXTRA_SRCS) -o $@ $(LDLIBS)

$(BUILD)/test-%: tests/test-%.c kvr.h $(BUILD)/libkvr.a | $(BUILD)
	$(CC) $(CFLAGS) $< $(BUILD)/libkvr.a $(EXTRA_SRCS) -o $@ $(LDLIBS)

# the sanitizer build: the library compiled again with ASan + UBSan
$(ASAN)/kvr.o: $(LIB_DEPS) | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) -c kvr.c -o $@

$(ASAN)/kvr-comm.o: $(LIB_DEPS) | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) -c kvr-comm.c -o $@

$(ASAN)/kvr-tune.o: $(LIB_DEPS) | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) -c kvr-tune.c -o $@

$(ASAN)/test-%: tests/test-%.c kvr.h $(ASAN)/kvr.o $(ASAN)/kvr-comm.o $(ASAN)/kvr-tune.o | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) $< $(ASAN)/kvr.o $(ASAN)/kvr-comm.o $(ASAN)/kvr-tune.o $(EXTRA_SRCS) -o $@ $(LDLIBS)

$(BUILD)/fuzz-gguf: tests/fuzz-gguf.c $(LIB_DEPS) | $(BUILD)
	$(CLANG) -std=c11 -O1 -g -I. -pthread -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all $(WARN) $< $(LIB_SRCS) $(EXTRA_SRCS) -o $@ $(LDLIBS)

tests: $(TESTS) $(BUILD)/simple

# simple.c is the smallest embedding: it must build from kvr.h and kvr.c alone
$(BUILD)/simple: tools/simple.c kvr.h kvr.c | $(BUILD)
	$(CC) $(CFLAGS) tools/simple.c kvr.c $(EXTRA_SRCS) -o $@ $(LDLIBS)

# the MPI build of kvr-run, when OpenMPI's compiler is installed (tests/e2e.sh runs it under mpirun)
MPICC := $(shell command -v mpicc 2>/dev/null)
MPI_RUN := $(if $(MPICC),$(BUILD)/mpi/kvr-run $(BUILD)/mpi/test-parallel,)
mpi: $(MPI_RUN)

$(BUILD)/mpi/kvr.o: $(LIB_DEPS)
	mkdir -p $(BUILD)/mpi
	$(MPICC) $(CFLAGS) -DKVR_MPI -c kvr.c -o $@

$(BUILD)/mpi/kvr-comm.o: $(LIB_DEPS)
	mkdir -p $(BUILD)/mpi
	$(MPICC) $(CFLAGS) -DKVR_MPI -c kvr-comm.c -o $@

$(BUILD)/mpi/%: tools/%.c kvr.h $(BUILD)/mpi/kvr.o $(BUILD)/mpi/kvr-comm.o $(BUILD)/kvr-tune.o
	$(MPICC) $(CFLAGS) -DKVR_MPI $< $(BUILD)/mpi/kvr.o $(BUILD)/mpi/kvr-comm.o $(BUILD)/kvr-tune.o -o $@ $(LDLIBS)

$(BUILD)/mpi/test-%: tests/test-%.c kvr.h $(BUILD)/mpi/kvr.o $(BUILD)/mpi/kvr-comm.o $(BUILD)/kvr-tune.o
	$(MPICC) $(CFLAGS) -DKVR_MPI $< $(BUILD)/mpi/kvr.o $(BUILD)/mpi/kvr-comm.o $(BUILD)/kvr-tune.o -o $@ $(LDLIBS)

test: all tests $(ASAN_TESTS) $(MPI_RUN) $(BUILD)/fuzz-gguf
	SHARED=$(SHARED) FUZZ_SECONDS=$(FUZZ_SECONDS) sh tests/run-tests.sh $(BUILD) $(ASAN)

# the main job on an embedded default: parallel prefill of a story on 2 ranks
demo: all
	sh tools/demo.sh $(BUILD) $(SHARED)

test-fast: all tests
	SHARED=$(SHARED) sh tests/run-tests.sh $(BUILD)

fuzz: $(BUILD)/fuzz-gguf
	mkdir -p $(BUILD)/fuzz-corpus
	$(BUILD)/test-gguf --write-corpus $(BUILD)/fuzz-corpus >/dev/null
	$(BUILD)/fuzz-gguf -max_total_time=60 -timeout=10 -rss_limit_mb=2048 -artifact_prefix=$(BUILD)/ $(BUILD)/fuzz-corpus

bench: all
	sh tests/bench.sh $(BUILD)
	python3 tests/paper-tables.py $(BUILD) $(BUILD)/bench/paper-tables.md
	@echo "the simulated paper setting: $(BUILD)/bench/paper-tables.md"

install: all
	mkdir -p $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	cp kvr.h $(DESTDIR)$(PREFIX)/include/
	cp $(BUILD)/libkvr.a $(DESTDIR)$(PREFIX)/lib/
	for t in $(filter-out $(BUILD)/simple,$(TOOLS)); do cp $$t $(DESTDIR)$(PREFIX)/bin/; done
	printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: kvr\nDescription: parallel-prefill LLM inference runtime\nVersion: 0.1.0\nLibs: -L$${libdir} -lkvr -lopenblas -lm -lpthread\nCflags: -I$${includedir}\n' \
		'$(PREFIX)' > $(DESTDIR)$(PREFIX)/lib/pkgconfig/kvr.pc

clean:
	rm -rf $(BUILD)
