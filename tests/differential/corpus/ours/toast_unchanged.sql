-- OURS: issue 16 bug 2: tables whose every column is out of line (TOASTed) on an UPDATE that rewrites them to
-- themselves: with REPLICA IDENTITY FULL and nothing but toasted columns, the new tuple is all "unchanged TOAST"
CREATE TABLE toast_only_full (big text, doc jsonb);
ALTER TABLE toast_only_full REPLICA IDENTITY FULL;
CREATE TABLE toast_only (id int PRIMARY KEY, big text, doc jsonb);
INSERT INTO toast_only_full SELECT (SELECT string_agg(md5(g || '.' || i), '') FROM generate_series(1, 600) i), jsonb_build_object('g', g, 'k', (SELECT string_agg(md5(i || '/' || g), '') FROM generate_series(1, 300) i)) FROM generate_series(1, 10) g;
INSERT INTO toast_only SELECT g, (SELECT string_agg(md5(g || '.' || i), '') FROM generate_series(1, 600) i), jsonb_build_object('k', (SELECT string_agg(md5(i || '/' || g), '') FROM generate_series(1, 300) i)) FROM generate_series(1, 10) g;
