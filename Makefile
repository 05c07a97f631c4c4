# kvr - build, test, bench, install. Plain GNU make; dependencies come from Debian's packages
# (see README.md): OpenBLAS, stb, and for the optional parts OpenMPI and the CUDA toolkit.
#
#   make              library and tools into build/
#   make KVR_CUDA=1   the same with the CUDA backend (nvcc, cuBLAS; sm_80 and sm_90 plus PTX)
#   make test         every test (plus a second build under ASan+UBSan, bounded fuzz runs and,
#                     where nvcc is installed, the CUDA build in build/cuda as a compile gate)
#   make bench        the benchmarks (long: a few hours; not part of make test): the matrix first, kvr-server's too
#   make bench-short  the speed matrix's short form (about 10 min): real files and one mixture, beside
#                     llama.cpp's llama-bench when it is on the PATH (or at LLAMA_BENCH)
#   make bench-archs  make bench's MoE and hybrid rows alone, beside llama-bench likewise
#   make gpu-check    on a machine with an NVIDIA GPU: the GPU's tests, kvr-compare on every
#                     reference model, a speed table (under 8 min; tests/gpu-check.sh). Without one:
#                     says so, exit 2. make gpu-pack: the folder it runs from (gpu-pack/)
#   make fuzz-cli     kvr-run's command line under libFuzzer for FUZZ_CLI_SECONDS (default 30 min)
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
# make KVR_CUDA=1: the CUDA backend, kvr-cuda.cu, compiled by nvcc for sm_80 and sm_90 plus PTX
# for newer GPUs, warnings as errors on the device and the host side; ptxas reports registers
# and spills (-Xptxas -v) into $(BUILD)/kvr-cuda.ptxas, a summary of the spills is printed.
NVCC      ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90
NVCCFLAGS ?= -std=c++17 -O2 $(CUDA_ARCH) -Werror all-warnings -Xptxas -v \
             -Xcompiler -Wall,-Wextra,-Werror,-ffp-contract=off,-fno-math-errno
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++
# NCCL (the transport of GPU ranks, compiled into kvr-comm.c with KVR_CUDA=1): shipped with the
# toolkit here ($(CUDA_HOME)/lib); NCCL_HOME=/usr where Debian's libnccl-dev provides it
NCCL_HOME ?= $(CUDA_HOME)
NCCL_DEFS := -DKVR_NCCL -I$(CUDA_HOME)/include -I$(NCCL_HOME)/include
NCCL_LIBS := -L$(NCCL_HOME)/lib -Wl,-rpath,$(NCCL_HOME)/lib -lnccl
ifeq ($(KVR_CUDA),1)
LIB_OBJS_CUDA := $(BUILD)/kvr-cuda.o
COMM_DEFS := $(NCCL_DEFS)
LDLIBS    += $(NCCL_LIBS)
NVCC_LIBS := -L$(NCCL_HOME)/lib -Xlinker -rpath,$(NCCL_HOME)/lib -lnccl # what nvcc links into a program with libkvr.a
KVR_DEFS  := -DKVR_CUDA   # kvr.c, the tools and tests (kvr.h declares the CUDA entry points)
LDLIBS    += $(CUDA_LIBS)
endif
TOOLS     := $(patsubst tools/%.c,$(BUILD)/%,$(filter-out tools/kvr-server.c,$(wildcard tools/*.c)))
# kvr-server needs libmicrohttpd and jansson (Debian's libmicrohttpd-dev, libjansson-dev; installed
# by tools/install-deps.sh): built where pkg-config finds both, said and skipped where it does not
SERVER_LIBS := $(shell pkg-config --libs libmicrohttpd jansson 2>/dev/null)
SERVER_OK   := $(shell pkg-config --exists libmicrohttpd jansson 2>/dev/null && echo 1)
ifeq ($(SERVER_OK),1)
TOOLS     += $(BUILD)/kvr-server
SERVER_ASAN := $(ASAN)/kvr-server
else
$(info kvr-server is not built: libmicrohttpd and jansson were not found by pkg-config (tools/install-deps.sh installs libmicrohttpd-dev and libjansson-dev))
endif
TESTS     := $(patsubst tests/%.c,$(BUILD)/%,$(filter-out tests/fuzz-%.c,$(wildcard tests/test-*.c)))
ASAN_TESTS:= $(patsubst tests/%.c,$(ASAN)/%,$(filter-out tests/fuzz-%.c,$(wildcard tests/test-*.c)))
SANFLAGS  := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all

.PHONY: all tools tests test test-fast test-asan fuzz fuzz-cli bench bench-short bench-archs install clean help demo mpi cuda-gate cuda-parts gpu-check gpu-pack gpu-pack-parts FORCE

all: $(BUILD)/libkvr.a tools

help:
	@sed -n '1,17p' Makefile

$(BUILD) $(ASAN):
	mkdir -p $@

# The options a build was made with: objects are remade when they change (make, then make KVR_CUDA=1).
BUILD_CONFIG := CC=$(CC) KVR_MPI=$(KVR_MPI) KVR_CUDA=$(KVR_CUDA) CFLAGS=$(CFLAGS)
$(BUILD)/config: FORCE | $(BUILD)
	@echo '$(BUILD_CONFIG)' | cmp -s - $@ || echo '$(BUILD_CONFIG)' > $@
FORCE:

$(BUILD)/kvr.o: $(LIB_DEPS) $(BUILD)/config | $(BUILD)
	$(CC) $(CFLAGS) $(KVR_DEFS) -c kvr.c -o $@

$(BUILD)/kvr-cuda.o: kvr-cuda.cu kvr.h $(BUILD)/config | $(BUILD)
	@test -n "$(NVCC)" || { echo "make KVR_CUDA=1 needs nvcc (the CUDA toolkit): not found"; exit 1; }
	$(NVCC) $(NVCCFLAGS) -I. -DKVR_CUDA -c kvr-cuda.cu -o $@ 2> $(BUILD)/kvr-cuda.ptxas || { cat $(BUILD)/kvr-cuda.ptxas; exit 1; }
	@awk '/Compiling entry function/ { f = $$(NF-2) " " $$NF } /bytes spill stores/ && ($$5 > 0 || $$9 > 0) { n++; print "kvr-cuda: spills in " f ": " $$0 } \
	     END { print "kvr-cuda: " (n ? n : 0) " kernel builds spill registers (details: $(BUILD)/kvr-cuda.ptxas)" }' $(BUILD)/kvr-cuda.ptxas

# the host test of the CUDA build: nvcc's host build of kvr.h's shared math against the C build
$(BUILD)/cuda-host-c.o: tests/cuda-host-c.c kvr.h $(BUILD)/config | $(BUILD)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/test-cuda-host: tests/test-cuda-host.cu kvr.h $(BUILD)/cuda-host-c.o $(BUILD)/libkvr.a | $(BUILD)
	$(NVCC) -std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-ffp-contract=off,-fno-math-errno \
		-I. -DKVR_CUDA $< $(BUILD)/cuda-host-c.o $(BUILD)/libkvr.a -o $@ -lopenblas -lm -lpthread -lcublas $(NVCC_LIBS)

$(BUILD)/kvr-comm.o: $(LIB_DEPS) $(BUILD)/config | $(BUILD)
	$(CC) $(CFLAGS) $(KVR_DEFS) $(COMM_DEFS) -c kvr-comm.c -o $@

$(BUILD)/kvr-tune.o: $(LIB_DEPS) $(BUILD)/config | $(BUILD)
	$(CC) $(CFLAGS) -c kvr-tune.c -o $@

$(BUILD)/libkvr.a: $(BUILD)/kvr.o $(BUILD)/kvr-comm.o $(BUILD)/kvr-tune.o $(LIB_OBJS_CUDA)
	rm -f $@
	ar rcs $@ $^

tools: $(TOOLS)

$(BUILD)/%: tools/%.c kvr.h $(wildcard tools/*.h) $(BUILD)/libkvr.a | $(BUILD)
	$(CC) $(CFLAGS) $(KVR_DEFS) $< $(BUILD)/libkvr.a $(EXTRA_SRCS) -o $@ $(LDLIBS)

$(BUILD)/kvr-server: tools/kvr-server.c kvr.h $(BUILD)/libkvr.a | $(BUILD)
	$(CC) $(CFLAGS) $(KVR_DEFS) $< $(BUILD)/libkvr.a $(EXTRA_SRCS) -o $@ $(LDLIBS) $(SERVER_LIBS)

$(BUILD)/test-%: tests/test-%.c kvr.h $(wildcard tests/*.h) $(BUILD)/libkvr.a | $(BUILD)
	$(CC) $(CFLAGS) $(KVR_DEFS) $< $(BUILD)/libkvr.a $(EXTRA_SRCS) -o $@ $(LDLIBS)

# the sanitizer build: the library compiled again with ASan + UBSan
$(ASAN)/kvr.o: $(LIB_DEPS) | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) -c kvr.c -o $@

$(ASAN)/kvr-comm.o: $(LIB_DEPS) | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) -c kvr-comm.c -o $@

$(ASAN)/kvr-tune.o: $(LIB_DEPS) | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) -c kvr-tune.c -o $@

$(ASAN)/test-%: tests/test-%.c kvr.h $(wildcard tests/*.h) $(ASAN)/kvr.o $(ASAN)/kvr-comm.o $(ASAN)/kvr-tune.o | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) $< $(ASAN)/kvr.o $(ASAN)/kvr-comm.o $(ASAN)/kvr-tune.o $(EXTRA_SRCS) -o $@ $(LDLIBS)

# the server under ASan + UBSan (tests/server.sh runs a short session against it)
$(ASAN)/kvr-server: tools/kvr-server.c kvr.h $(ASAN)/kvr.o $(ASAN)/kvr-comm.o $(ASAN)/kvr-tune.o | $(ASAN)
	$(CC) $(filter-out $(OPT),$(CFLAGS)) $(SANFLAGS) $< $(ASAN)/kvr.o $(ASAN)/kvr-comm.o $(ASAN)/kvr-tune.o $(EXTRA_SRCS) -o $@ $(LDLIBS) $(SERVER_LIBS)

# the fuzz targets: the library built once with clang's sanitizers and fuzzer instrumentation
FUZZFLAGS := -std=c11 -O1 -g -I. -pthread -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all $(WARN)
FUZZ_OBJS := $(patsubst %.c,$(BUILD)/fuzz/%.o,$(LIB_SRCS))

$(BUILD)/fuzz/%.o: %.c $(LIB_DEPS)
	mkdir -p $(BUILD)/fuzz
	$(CLANG) $(FUZZFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(BUILD)/fuzz-gguf: tests/fuzz-gguf.c $(FUZZ_OBJS) | $(BUILD)
	$(CLANG) $(FUZZFLAGS) -fsanitize=fuzzer $< $(FUZZ_OBJS) $(EXTRA_SRCS) -o $@ $(LDLIBS)

# the readers of KV cache files and replication logs, on the same instrumented library
$(BUILD)/fuzz-kvfile: tests/fuzz-kvfile.c $(FUZZ_OBJS) | $(BUILD)
	$(CLANG) $(FUZZFLAGS) -fsanitize=fuzzer $< $(FUZZ_OBJS) $(EXTRA_SRCS) -o $@ $(LDLIBS)

# kvr-run's whole command line in-process (tests/fuzz-cli.c includes tools/kvr-run.c); its library
# keeps edge coverage but not comparison tracing, which would slow every matmul of every run ~4x
FUZZ_CLI_OBJS := $(patsubst %.c,$(BUILD)/fuzz-cli-lib/%.o,$(LIB_SRCS))

$(BUILD)/fuzz-cli-lib/%.o: %.c $(LIB_DEPS)
	mkdir -p $(BUILD)/fuzz-cli-lib
	$(CLANG) $(FUZZFLAGS) -fsanitize=fuzzer-no-link -fno-sanitize-coverage=trace-cmp -c $< -o $@

$(BUILD)/fuzz-cli: tests/fuzz-cli.c tools/kvr-run.c $(wildcard tools/*.h) $(FUZZ_CLI_OBJS) | $(BUILD)
	$(CLANG) $(FUZZFLAGS) -fsanitize=fuzzer $< $(FUZZ_CLI_OBJS) $(EXTRA_SRCS) -o $@ $(LDLIBS)

tests: $(TESTS) $(BUILD)/simple $(if $(filter 1,$(KVR_CUDA)),$(BUILD)/test-cuda-host)

# simple.c is the smallest embedding: it must build from kvr.h, kvr.c and kvr-comm.c alone
$(BUILD)/simple: tools/simple.c kvr.h kvr.c kvr-comm.c | $(BUILD)
	$(CC) $(CFLAGS) tools/simple.c kvr.c kvr-comm.c $(EXTRA_SRCS) -o $@ $(LDLIBS)

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

$(BUILD)/mpi/test-%: tests/test-%.c kvr.h $(wildcard tests/*.h) $(BUILD)/mpi/kvr.o $(BUILD)/mpi/kvr-comm.o $(BUILD)/kvr-tune.o
	$(MPICC) $(CFLAGS) -DKVR_MPI $< $(BUILD)/mpi/kvr.o $(BUILD)/mpi/kvr-comm.o $(BUILD)/kvr-tune.o -o $@ $(LDLIBS)

# The CUDA build as a compile gate of make test wherever nvcc is installed (CI has it): the
# library, kvr-run, kvr-compare, test-ops and the host test, in $(BUILD)/cuda. tests/run-tests.sh
# runs what of them can run without a GPU.
CUDA_GATE := $(if $(NVCC),$(if $(filter 1,$(KVR_CUDA)),,cuda-gate),)
cuda-gate:
	@t0=$$(date +%s); $(MAKE) --no-print-directory BUILD=$(BUILD)/cuda KVR_CUDA=1 cuda-parts && \
	echo "the CUDA build ($(BUILD)/cuda) took $$(( $$(date +%s) - t0 )) s"
cuda-parts: $(BUILD)/libkvr.a $(BUILD)/kvr-run $(BUILD)/kvr-compare $(BUILD)/test-ops $(BUILD)/test-cuda-host

# make gpu-check runs from one folder that also travels alone to a bare machine with a GPU (the
# CUDA toolkit and driver, nothing else): gpu-pack/ (ignored by git), made from a CUDA build for
# any x86-64 with AVX2 (the GPU machine's processor is not this one) by tests/gpu-check.sh pack.
GPU_PACK  ?= gpu-pack
gpu-pack:
	$(MAKE) --no-print-directory BUILD=$(BUILD)/gpu-pack KVR_CUDA=1 ARCHFLAGS=-march=x86-64-v3 gpu-pack-parts
	sh tests/gpu-check.sh pack $(BUILD)/gpu-pack $(SHARED) $(GPU_PACK)
gpu-pack-parts: $(BUILD)/libkvr.a $(BUILD)/kvr-run $(BUILD)/kvr-compare $(BUILD)/kvr-bench $(BUILD)/kvr-gen \
                $(BUILD)/test-ops $(BUILD)/test-cuda-host

gpu-check:
	@sh tests/gpu-check.sh probe
	$(MAKE) --no-print-directory gpu-pack
	sh tests/gpu-check.sh run $(GPU_PACK)

test: all tests $(ASAN_TESTS) $(SERVER_ASAN) $(MPI_RUN) $(BUILD)/fuzz-gguf $(BUILD)/fuzz-kvfile $(BUILD)/fuzz-cli $(CUDA_GATE)
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

# the long run of kvr-run's command line (make test runs it for FUZZ_SECONDS)
FUZZ_CLI_SECONDS ?= 1800
fuzz-cli: $(BUILD)/fuzz-cli
	mkdir -p $(BUILD)/fuzz-cli-corpus
	KVR_FUZZ_MODEL=$(SHARED)/models/stories260K.gguf KVR_FUZZ_CLI_SEEDS=$(BUILD)/fuzz-cli-corpus \
		$(BUILD)/fuzz-cli -max_total_time=$(FUZZ_CLI_SECONDS) -timeout=60 \
		-rss_limit_mb=4096 -close_fd_mask=3 -artifact_prefix=$(BUILD)/fuzz-cli- $(BUILD)/fuzz-cli-corpus

bench: all
	sh tests/bench-matrix.sh $(BUILD)
	sh tests/bench.sh $(BUILD)
	python3 tests/paper-tables.py $(BUILD) $(BUILD)/bench/paper-tables.md
	@echo "the simulated paper setting: $(BUILD)/bench/paper-tables.md"
	$(if $(SERVER_OK),python3 tools/server-bench.py $(BUILD) --out $(BUILD)/bench/server.md,@echo "kvr-server is not built: its bench is skipped")

bench-short: all
	sh tests/bench-matrix.sh $(BUILD) short

bench-archs: all
	sh tests/bench.sh $(BUILD) archs

install: all
	mkdir -p $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	cp kvr.h $(DESTDIR)$(PREFIX)/include/
	cp $(BUILD)/libkvr.a $(DESTDIR)$(PREFIX)/lib/
	for t in $(filter-out $(BUILD)/simple,$(TOOLS)); do cp $$t $(DESTDIR)$(PREFIX)/bin/; done
	printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: kvr\nDescription: parallel-prefill LLM inference runtime\nVersion: 0.1.0\nLibs: -L$${libdir} -lkvr -lopenblas -lm -lpthread\nCflags: -I$${includedir}\n' \
		'$(PREFIX)' > $(DESTDIR)$(PREFIX)/lib/pkgconfig/kvr.pc

clean:
	rm -rf $(BUILD)
