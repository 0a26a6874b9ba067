/*
 * replay_main.c - runs a fuzz harness over every file of its corpus folder,
 * so that the corpus is an ordinary regression test wherever libFuzzer is not
 * used. Fails when the folder is missing or empty (a test that runs nothing
 * must not pass).
 */
#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    if (buf == NULL || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
        free(buf);
        fclose(f);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    DIR *d = opendir(argv[1]);
    if (d == NULL) {
        fprintf(stderr, "%s: cannot open corpus %s\n", argv[0], argv[1]);
        return 1;
    }
    int count = 0, failed = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", argv[1], e->d_name);
        if (replay(path) != 0) {
            fprintf(stderr, "cannot read %s\n", path);
            failed++;
        }
        count++;
    }
    closedir(d);
    printf("replayed %d inputs from %s\n", count, argv[1]);
    return count == 0 || failed ? 1 : 0;
}
