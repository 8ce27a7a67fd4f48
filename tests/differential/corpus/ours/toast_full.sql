-- OURS: REPLICA IDENTITY FULL with toasted columns (md5 hex strings: too little redundancy to compress below the
-- TOAST threshold, so they are stored out of line), and a table without any key (insert-only)
CREATE TABLE full_toast (a int, big text, doc jsonb, blob bytea);
ALTER TABLE full_toast REPLICA IDENTITY FULL;
CREATE TABLE no_key (a int, note text);
INSERT INTO full_toast SELECT g, (SELECT string_agg(md5(g || '.' || i), '') FROM generate_series(1, 600) i), jsonb_build_object('g', g, 'k', (SELECT string_agg(md5(i || '/' || g), '') FROM generate_series(1, 300) i)), decode((SELECT string_agg(md5(i || ':' || g), '') FROM generate_series(1, 400) i), 'hex') FROM generate_series(1, 20) g;
INSERT INTO no_key SELECT g, 'copied ' || g FROM generate_series(1, 50) g;
