/* A coverage-guided fuzzer over the layout record's parser (csrc/record.c):
 * what a zero-copy worker sends beside its block, which the main process
 * must refuse when it is cut short or changed (a worker killed mid-write,
 * bytes flipped) and never read past, nor let describe a view past the block.
 *
 * Each input: 5 bytes of block size (little-endian, up to 2**40), then the
 * record. For every input the parser must not read outside the input (ASan
 * sees it); when it takes the record, what it promises is checked without
 * its own code (record_writer.h's rw_promises: every leaf's elements inside
 * the block, indices in range, the structure holding exactly its leaves),
 * and the record with its last byte cut must be refused.
 *
 * Built as fuzz_arena.c is (tests/c/Makefile): a libFuzzer target with
 * clang -fsanitize=fuzzer (make fuzz), or with -DFUZZ_RECORD_MAIN a main()
 * that replays files and runs mutations of records written here, as
 * fastpin/_record.py writes them, and random inputs (make fuzz-smoke). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "record_writer.h"

static unsigned long taken; /* inputs the parser took */

static void run_one(const uint8_t *data, size_t size)
{
    if (size < 5)
        return;
    uint64_t block = 0;
    for (int i = 0; i < 5; i++)
        block |= (uint64_t)data[i] << (8 * i);
    /* A copy of exactly the record's bytes, so ASan sees any read past it. */
    size_t len = size - 5;
    uint8_t *rec = malloc(len ? len : 1);
    if (!rec)
        abort();
    memcpy(rec, data + 5, len);
    fp_record_t r;
    if (fp_record_parse(rec, len, block, &r) == FP_OK) {
        taken++;
        const char *broke = rw_promises(&r, block);
        if (broke) {
            fprintf(stderr, "fuzz_record: a record was taken, but %s (block %llu, %zu bytes)\n",
                    broke, (unsigned long long)block, len);
            abort();
        }
        if (fp_record_parse(rec, len - 1, block, &r) == FP_OK) {
            fprintf(stderr, "fuzz_record: a record cut by one byte was taken\n");
            abort();
        }
    }
    free(rec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    run_one(data, size);
    return 0;
}

/* ---- a driver for compilers without libFuzzer --------------------------- */

#ifdef FUZZ_RECORD_MAIN
#include "fuzz_driver.h"

enum { INPUT_MAX = 1 << 16, MAX_SEEDS = 256 };

typedef struct {
    uint8_t *data;
    size_t size;
} seed_t;

static seed_t seeds[MAX_SEEDS];
static size_t nseeds;
static unsigned long cases;

static void keep(const uint8_t *data, size_t size)
{
    run_one(data, size);
    cases++;
    if (nseeds < MAX_SEEDS && size <= INPUT_MAX) {
        uint8_t *copy = malloc(size);
        if (!copy)
            abort();
        memcpy(copy, data, size);
        seeds[nseeds++] = (seed_t){copy, size};
    }
}

static rw_t w;
static uint8_t input[INPUT_MAX];

/* A record of random shape, as a worker writes one: leaves of every kind
 * placed back to back at 256-byte offsets, in nested dicts, lists and
 * tuples with kept objects; the input is its block size, then it. */
static void write_seed(void)
{
    rw_begin(&w);
    int nleaves = (int)(rng() % 12);
    uint64_t offset = 0;
    uint32_t objects = 0;
    int depth = (int)(rng() % 4);
    for (int d = 0; d < depth; d++)
        rw_node(&w, FP_RECORD_NODE_LIST, 1);
    rw_node(&w, FP_RECORD_NODE_DICT, (uint32_t)nleaves + 1);
    objects += (uint32_t)nleaves + 1;
    for (int i = 0; i < nleaves; i++) {
        int ndim = (int)(rng() % 4);
        int64_t shape[4], strides[4];
        for (int k = 0; k < ndim; k++)
            shape[k] = (int64_t)(rng() % 5);
        static const uint8_t bits[] = {8, 16, 32, 64};
        uint8_t b = bits[rng() % 4];
        if (rng() % 2) {
            uint8_t code = (uint8_t)(rng() % 3); /* int, uint, float (of 16 bits or more) */
            rw_tensor(&w, offset, ndim, shape, code, code == 2 && b == 8 ? 16 : b);
        } else {
            for (int k = ndim - 1, step = 1; k >= 0; k--) {
                strides[k] = step;
                step *= shape[k] > 1 ? (int)shape[k] : 1;
            }
            rw_leaf(&w, FP_RECORD_ARRAY, offset, b / 8u, ndim, shape, strides,
                    FP_RECORD_NONE, 7, 0, 0, 0);
        }
        fp_record_leaf_t l;
        fp_record_t view = {.entries = w.entries, .dims = (const uint8_t *)w.dims,
                            .nleaves = w.nleaves, .ndims = w.ndims};
        fp_record_leaf(&view, w.nleaves - 1, &l);
        offset += (l.nbytes + 255) & ~255ull;
        if (rng() % 3 == 0) {
            rw_node(&w, FP_RECORD_NODE_TUPLE, 2);
            rw_node(&w, FP_RECORD_NODE_OBJECT, 0);
            objects++;
        }
        rw_node(&w, FP_RECORD_NODE_LEAF, 0);
    }
    rw_node(&w, FP_RECORD_NODE_ORDINARY, 0);
    objects++;
    rw_finish(&w, objects);
    uint64_t block = offset + rng() % 300;
    for (int i = 0; i < 5; i++)
        input[i] = (uint8_t)(block >> (8 * i));
    memcpy(input + 5, w.out, w.len);
    keep(input, 5 + w.len);
}

static void replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(2);
    }
    size_t n = fread(input, 1, INPUT_MAX, f);
    fclose(f);
    keep(input, n);
}

/* Replays the files and folders named, writes 64 seed records, then runs
 * FUZZ_CASES inputs (default 2000): mostly a seed with a few bytes changed,
 * cut or lengthened, else random bytes. The seed is FUZZ_SEED (default 1). */
int main(int argc, char **argv)
{
    unsigned long n = fuzz_start(argc, argv, replay_file);
    for (int i = 0; i < 64; i++)
        write_seed();
    static uint8_t buf[INPUT_MAX];
    for (unsigned long c = 0; c < n; c++) {
        size_t len;
        if (nseeds && rng() % 8) {
            seed_t *s = &seeds[rng() % nseeds];
            len = s->size;
            memcpy(buf, s->data, len);
            for (int k = 1 + (int)(rng() % 4); k-- && len;)
                buf[rng() % len] ^= (uint8_t)(1u << (rng() % 8));
            if (rng() % 4 == 0 && len)
                len = rng() % len; /* cut short */
        } else {
            len = 1 + rng() % 512;
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rng();
        }
        run_one(buf, len);
        cases++;
    }
    for (size_t i = 0; i < nseeds; i++)
        free(seeds[i].data);
    printf("fuzz_record: %lu cases, %lu records taken\n", cases, taken);
    return 0;
}
#endif
