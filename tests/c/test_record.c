/* The layout record's parser (csrc/record.c): a record as a worker writes it
 * is read back exactly; a record cut short anywhere, or with any byte
 * changed, is refused or describes only views inside the block; each way a
 * record can lie is refused with a message that says so. */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "record_writer.h"

static int failures;

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                 \
            fprintf(stderr, __VA_ARGS__);                                   \
            fprintf(stderr, " (%s)\n", fp_error_message());                 \
            failures++;                                                     \
        }                                                                   \
    } while (0)

static rw_t w;

/* {"a": tensor 3x4 float32, "b": [array 5 int16, None, tensor 0-d], "c": ()}
 * in a block of 4096 bytes; objects: keys a b c, None. */
static uint64_t sample(void)
{
    rw_begin(&w);
    int64_t s34[] = {3, 4}, s5[] = {5}, one[] = {1};
    rw_tensor(&w, 0, 2, s34, 2, 32);
    rw_leaf(&w, FP_RECORD_ARRAY, 256, 2, 1, s5, one, FP_RECORD_NONE, 3, 0, 0, 0);
    rw_tensor(&w, 512, 0, NULL, 0, 64);
    rw_node(&w, FP_RECORD_NODE_DICT, 3);
    rw_node(&w, FP_RECORD_NODE_LEAF, 0);
    rw_node(&w, FP_RECORD_NODE_LIST, 3);
    rw_node(&w, FP_RECORD_NODE_LEAF, 0);
    rw_node(&w, FP_RECORD_NODE_OBJECT, 0);
    rw_node(&w, FP_RECORD_NODE_LEAF, 0);
    rw_node(&w, FP_RECORD_NODE_TUPLE, 0);
    rw_finish(&w, 4);
    return 4096;
}

static int parse(uint64_t block, fp_record_t *r)
{
    return fp_record_parse(w.out, w.len, block, r);
}

static void test_round_trip(void)
{
    uint64_t block = sample();
    fp_record_t r;
    CHECK(parse(block, &r) == FP_OK, "the sample record parses");
    CHECK(r.nleaves == 3 && r.nobjects == 4 && r.node_objects == 4, "counts");
    fp_record_leaf_t l;
    fp_record_leaf(&r, 0, &l);
    CHECK(l.kind == FP_RECORD_TENSOR && l.ndim == 2 && l.shape[0] == 3 && l.shape[1] == 4 &&
              l.strides[0] == 4 && l.strides[1] == 1 && l.code == 2 && l.bits == 32 &&
              l.type == 1 && l.nbytes == 48 && l.offset == 0,
          "leaf 0 reads back");
    fp_record_leaf(&r, 1, &l);
    CHECK(l.kind == FP_RECORD_ARRAY && l.offset == 256 && l.type == 3 && l.nbytes == 10,
          "leaf 1 reads back");
    fp_record_leaf(&r, 2, &l);
    CHECK(l.ndim == 0 && l.nbytes == 8 && l.offset == 512, "leaf 2 (0-d) reads back");
    CHECK(rw_promises(&r, block) == NULL, "the sample keeps its promises");
    /* Exactly as big as it needs: the last leaf ends at 520. */
    CHECK(parse(520, &r) == FP_OK, "a block just big enough");
    CHECK(parse(519, &r) == FP_EINVAL && strstr(fp_error_message(), "past the block"),
          "a block one byte short is refused");
}

static void test_every_truncation_is_refused(void)
{
    uint64_t block = sample();
    size_t full = w.len;
    fp_record_t r;
    for (size_t n = 0; n < full; n++) {
        int status = fp_record_parse(w.out, n, block, &r);
        CHECK(status == FP_EINVAL, "a record cut to %zu of %zu bytes is refused", n, full);
    }
    CHECK(fp_record_parse(w.out, full, block, &r) == FP_OK, "the whole one is not");
}

static void test_every_changed_byte_is_refused_or_safe(void)
{
    uint64_t block = sample();
    static const uint8_t flips[] = {0x01, 0x02, 0x10, 0x80, 0xff};
    int refused = 0, taken = 0;
    for (size_t i = 0; i < w.len; i++)
        for (size_t f = 0; f < sizeof flips; f++) {
            w.out[i] ^= flips[f];
            fp_record_t r;
            if (fp_record_parse(w.out, w.len, block, &r) == FP_OK) {
                const char *broke = rw_promises(&r, block);
                CHECK(broke == NULL, "byte %zu ^ 0x%02x: parsed, but %s", i, flips[f], broke);
                taken++;
            } else {
                refused++;
            }
            w.out[i] ^= flips[f];
        }
    CHECK(refused > 0 && taken > 0, "some changes refused (%d), some harmless (%d)", refused,
          taken);
}

/* The record with one field of leaf 0's entry (at byte `at`, `bytes` long)
 * set to v, parsed against a 4096-byte block; the message must hold `says`. */
static void refuse_entry(size_t at, int bytes, uint64_t v, const char *says)
{
    sample();
    rw_put(w.out + FP_RECORD_HEADER + at, v, bytes);
    fp_record_t r;
    int status = parse(4096, &r);
    CHECK(status == FP_EINVAL && strstr(fp_error_message(), says),
          "entry byte %zu = %llu: refused saying \"%s\"", at, (unsigned long long)v, says);
}

static void test_each_lie_is_refused(void)
{
    refuse_entry(0, 8, 4096, "past the block");          /* offset */
    refuse_entry(0, 8, UINT64_MAX & ~255ull, "past the block");
    refuse_entry(0, 8, 100, "not a multiple");           /* unaligned */
    refuse_entry(8, 8, 47, "bytes for");                 /* nbytes */
    refuse_entry(16, 4, 8, "elements of");               /* itemsize vs bits */
    refuse_entry(32, 1, 3, "none fastpin exports");      /* DLPack code: opaque */
    refuse_entry(33, 1, 24, "none fastpin exports");     /* float of 24 bits */
    refuse_entry(28, 2, 2, "none fastpin exports");      /* two lanes of float32 */
    refuse_entry(24, 4, 4, "names object");              /* dtype object */
    refuse_entry(30, 1, 9, "unknown kind");
    refuse_entry(31, 1, 65, "dimensions");
    refuse_entry(31, 1, 40, "past the dims");
    refuse_entry(34, 1, 4, "unknown flags");
    refuse_entry(36, 1, 1, "padding");
    /* Dims: a huge stride, a negative size, an element count that overflows. */
    sample();
    uint8_t *dims = w.out + FP_RECORD_HEADER + 3 * FP_RECORD_ENTRY;
    fp_record_t r;
    rw_put(dims + 16, (uint64_t)1 << 61, 8); /* leaf 0's first stride */
    CHECK(parse(4096, &r) == FP_EINVAL, "a stride past the block is refused");
    sample();
    rw_put(dims, (uint64_t)-3, 8);
    CHECK(parse(4096, &r) == FP_EINVAL && strstr(fp_error_message(), "negative"),
          "a negative size is refused");
    sample();
    rw_put(dims, (uint64_t)1 << 40, 8);
    rw_put(dims + 8, (uint64_t)1 << 40, 8);
    CHECK(parse(4096, &r) == FP_EINVAL && strstr(fp_error_message(), "overflows"),
          "an element count past int64 is refused");
    /* Header: magic, reserved, a count that disagrees with the length. */
    sample();
    w.out[0] ^= 1;
    CHECK(parse(4096, &r) == FP_EINVAL && strstr(fp_error_message(), "not a fastpin"), "magic");
    sample();
    w.out[31] = 1;
    CHECK(parse(4096, &r) == FP_EINVAL && strstr(fp_error_message(), "reserved"), "reserved");
    sample();
    rw_put(w.out + 8, 0xffffffffu, 4);
    CHECK(parse(4096, &r) == FP_EINVAL && strstr(fp_error_message(), "truncated"),
          "a leaf count past the record's end");
    /* Structure: too few objects sent, a leaf node too many or too few. */
    sample();
    rw_put(w.out + 20, 3, 4);
    CHECK(parse(4096, &r) == FP_EINVAL && strstr(fp_error_message(), "objects"),
          "a dict whose keys were not all sent");
    sample();
    w.out[w.len - 1] = 1; /* the last byte is the high byte of the tuple's count */
    CHECK(parse(4096, &r) == FP_EINVAL, "a changed count byte");
    sample();
    w.out[w.len - 5] = 77;
    CHECK(parse(4096, &r) == FP_EINVAL && strstr(fp_error_message(), "unknown node"),
          "an unknown node");
}

/* A leaf inside `depth` nested lists. */
static void nested(int depth)
{
    rw_begin(&w);
    int64_t s[] = {2};
    rw_tensor(&w, 0, 1, s, 1, 8);
    for (int d = 0; d < depth; d++)
        rw_node(&w, FP_RECORD_NODE_LIST, 1);
    rw_node(&w, FP_RECORD_NODE_LEAF, 0);
    rw_finish(&w, 0);
}

static void test_depth(void)
{
    fp_record_t r;
    nested(50);
    CHECK(parse(256, &r) == FP_OK && rw_promises(&r, 256) == NULL, "50 deep is taken");
    nested(FP_RECORD_DEPTH);
    CHECK(parse(256, &r) == FP_OK, "%d deep is taken", FP_RECORD_DEPTH);
    nested(FP_RECORD_DEPTH + 1);
    CHECK(parse(256, &r) == FP_EINVAL && strstr(fp_error_message(), "deep"),
          "%d deep is refused", FP_RECORD_DEPTH + 1);
}

static void test_a_thousand_leaves_and_empty_ones(void)
{
    rw_begin(&w);
    rw_node(&w, FP_RECORD_NODE_LIST, 1000);
    for (int i = 0; i < 1000; i++) {
        int64_t s[] = {i % 7, 3};
        rw_tensor(&w, (uint64_t)i * 256, 2, s, 0, 32);
        rw_node(&w, FP_RECORD_NODE_LEAF, 0);
    }
    rw_finish(&w, 0);
    fp_record_t r;
    CHECK(parse(1000 * 256, &r) == FP_OK && rw_promises(&r, 1000 * 256) == NULL,
          "1,000 leaves");
    /* An empty leaf may start at the block's very end. */
    rw_begin(&w);
    int64_t s0[] = {0, 5};
    rw_tensor(&w, 512, 2, s0, 2, 32);
    rw_node(&w, FP_RECORD_NODE_LEAF, 0);
    rw_finish(&w, 0);
    CHECK(parse(512, &r) == FP_OK, "an empty leaf at the end of the block");
    CHECK(parse(256, &r) == FP_EINVAL, "but not past it");
}

int main(void)
{
    test_round_trip();
    test_every_truncation_is_refused();
    test_every_changed_byte_is_refused_or_safe();
    test_each_lie_is_refused();
    test_depth();
    test_a_thousand_leaves_and_empty_ones();
    if (failures) {
        fprintf(stderr, "test_record: %d checks failed\n", failures);
        return 1;
    }
    printf("test_record: ok\n");
    return 0;
}
